"""Predictions from a config: parameter counts, weights/KV/activation bytes, hardware profiles and the speed/cost ceilings."""
