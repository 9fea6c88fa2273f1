"""A run directory: where it is and its lock (`place`), its files' schemas and records (`layout`), its
parts, resume and final files (`rundir`)."""
