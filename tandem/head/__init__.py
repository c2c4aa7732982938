"""A trained block drafter beside the target (DSpark-style): model, drafting, file format, prompts."""
