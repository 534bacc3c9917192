"""rl_jax.data"""
