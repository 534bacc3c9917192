"""rl_jax.train"""
