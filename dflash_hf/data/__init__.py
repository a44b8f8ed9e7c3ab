"""Data stages: prompt sources (`prompts`), regenerated training data (`make`), cached target features (`features`)."""
