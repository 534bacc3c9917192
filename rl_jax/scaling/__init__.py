"""rl_jax.scaling"""
