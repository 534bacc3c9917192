"""rl_jax.sampling"""
