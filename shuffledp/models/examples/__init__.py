"""Example model plug-ins (issue 26): [model] module = "shuffledp.models.examples.flax_models:cnn" (needs
shuffledp[jax])."""
