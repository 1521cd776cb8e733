import os

# The explicit testing switch of shuffledp.rng: tests may use fixed seeds (never set outside tests).
os.environ["SHUFFLEDP_ALLOW_TEST_SEED"] = "1"
