"""The planner (`ember plan`): predict memory and step time of every parallel layout.

models.py (model shapes and presets), cluster.py (cluster and profile files), layout.py
(layouts and the search space), memory.py, comm.py and timing.py (bytes, links and
seconds), predict.py (one layout), search.py (all layouts), report.py and command.py (what
the user sees), calibrate.py (measure this machine into a profile). FLOPs come from
`ember.cost` and the GPU table from `ember.hardware`, which the trainer's MFU uses too."""
