"""``shardline plan``: what fits, how fast, and why, before a launch (issue 18). Model specifications
(:mod:`.models`), the planned layout (:mod:`.layout`), the memory estimator and the step-time model."""
