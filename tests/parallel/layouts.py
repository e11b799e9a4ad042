"""The layouts checked against one process. Each is a name, the `--set` values that make it,
Add a layout by adding a line."""

# Run in one launch of 2 processes.
TWO_RANKS = [
    {"name": "dp2", "set": {"parallel.zero": 0}},
    {"name": "zero1x2", "set": {"parallel.zero": 1}},
    {"name": "zero2x2", "set": {"parallel.zero": 2}},
    {"name": "zero3x2", "set": {"parallel.zero": 3}},
    {"name": "zero3x2+full-recompute", "set": {"parallel.zero": 3, "parallel.recompute": "full"}},
    {"name": "zero2x2+selective-recompute", "set": {"parallel.zero": 2, "parallel.recompute": "selective"}},
    {"name": "tp2", "set": {"parallel.tp": 2}},
    {"name": "tp2+sp", "set": {"parallel.tp": 2, "parallel.sp": True}},
    {"name": "pp2-gpipe", "set": {"parallel.pp": 2, "parallel.schedule": "gpipe"}},
    {"name": "pp2-1f1b", "set": {"parallel.pp": 2, "parallel.schedule": "1f1b"}},
    {"name": "pp2-interleaved", "set": {"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "interleaved"}},
    {"name": "pp2-stages-3+1", "set": {"parallel.pp": 2, "parallel.stage_layers": "[3,1]"}},
    {"name": "pp2-zero-bubble", "set": {"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "zero_bubble"}},
    {"name": "pp2-interleaved+selective-recompute", "set": {"parallel.pp": 2, "parallel.vpp": 2,
                                                            "parallel.schedule": "interleaved",
                                                            "parallel.recompute": "selective"}},
    {"name": "tp2+full-recompute-every-2", "set": {"parallel.tp": 2, "parallel.recompute": "full",
                                                    "parallel.recompute_every": 2}},
]

# Run in one launch of 4 processes.
FOUR_RANKS = [
    {"name": "hybrid2x2-zero3", "set": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 3}},
    {"name": "hybrid2x2-zero1", "set": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 1}},
    {"name": "dp2xtp2", "set": {"parallel.tp": 2, "parallel.zero": 1}},
    {"name": "zero3x2xtp2", "set": {"parallel.tp": 2, "parallel.zero": 3}},
    {"name": "zero2x2xtp2+sp+selective-recompute", "set": {"parallel.tp": 2, "parallel.sp": True, "parallel.zero": 2,
                                                            "parallel.recompute": "selective"}},
    {"name": "hybrid2x2-zero2", "set": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 2}},
    {"name": "pp2xtp2", "set": {"parallel.pp": 2, "parallel.tp": 2}},
    {"name": "pp2xtp2+sp", "set": {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True}},
    {"name": "pp2xdp2-zero1", "set": {"parallel.pp": 2, "parallel.zero": 1}},
    {"name": "pp2xdp2-zero2", "set": {"parallel.pp": 2, "parallel.zero": 2}},
    {"name": "pp2xzero3x2", "set": {"parallel.pp": 2, "parallel.zero": 3}},
    {"name": "pp2xdp2-zero1-zbv", "set": {"parallel.pp": 2, "parallel.zero": 1, "parallel.vpp": 2,
                                          "parallel.schedule": "zbv"}},
    {"name": "pp2xtp2-zero-bubble", "set": {"parallel.pp": 2, "parallel.tp": 2, "parallel.vpp": 2,
                                            "parallel.schedule": "zero_bubble"}},
    {"name": "pp2xzero3x2-zero-bubble", "set": {"parallel.pp": 2, "parallel.zero": 3, "parallel.vpp": 2,
                                                "parallel.schedule": "zero_bubble"}},
    {"name": "pp2xzero3x2-interleaved+full-recompute", "set": {"parallel.pp": 2, "parallel.zero": 3, "parallel.vpp": 2,
                                                               "parallel.schedule": "interleaved",
                                                               "parallel.recompute": "full"}},
    {"name": "pp2xtp2+sp-zbv", "set": {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.vpp": 2,
                                       "parallel.schedule": "zbv"}},
]

OBJECTIVES = ("causal", "mlm")
STEPS = 3
