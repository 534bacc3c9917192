"""rl_jax.losses"""
