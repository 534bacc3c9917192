"""rl_jax.rewards"""
