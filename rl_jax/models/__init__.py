"""rl_jax.models"""
