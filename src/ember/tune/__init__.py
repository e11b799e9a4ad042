"""Measuring layouts on this machine: `ember bench` (one layout's step, part by part) and
`ember tune` (the planner's best layouts confirmed with short trials). It sits above both
the trainer, whose run it measures, and the planner, whose predictions it checks."""
