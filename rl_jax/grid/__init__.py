"""rl_jax.grid"""
