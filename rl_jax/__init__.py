"""rl_jax: JAX-native RL post-training for LLMs, built for scaling experiments."""

__version__ = "0.1.0"
