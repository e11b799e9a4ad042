"""data.document_mask under data and tensor parallelism, with and without sequence
parallelism, and through FlexAttention, trains the same steps as one process with the
dense mask (loss and gradient norm within 1e-5). Attention sees the whole sequence in
every layout, so the (rows, sequence) document ids need no splitting beyond the
data-parallel rows."""


from ember.config import load_config
from ember.train.trainer import Trainer
from layouts import OBJECTIVES, STEPS
from test_layouts_match_one_process import COMMON, LR, RECIPE, assert_same, launch

MASK = {"data.document_mask": True}
LAYOUTS = [
    {"name": "dp2", "set": {"parallel.zero": 0, **MASK}},
    {"name": "zero3x2", "set": {"parallel.zero": 3, **MASK}},
    {"name": "tp2", "set": {"parallel.tp": 2, **MASK}},
    {"name": "tp2+sp", "set": {"parallel.tp": 2, "parallel.sp": True, **MASK}},
    # FlexAttention (CUDA's choice) forced on the CPU: the same steps as the dense mask.
    {"name": "zero3x2-flex", "set": {"parallel.zero": 3, "model.document_kernel": "flex", **MASK}},
    {"name": "tp2+sp-flex", "set": {"parallel.tp": 2, "parallel.sp": True, "model.document_kernel": "flex", **MASK}},
]


def test_masked_layouts_equal_one_masked_process(bounded_dataset, tmp_path):
    one_process = {}
    for objective in OBJECTIVES:
        cfg = load_config(RECIPE, COMMON + [f"model.objective={objective}", "data.document_mask=true"])
        trainer = Trainer(cfg, bounded_dataset, tmp_path / f"one-{objective}", progress=False)
        trainer.build()
        steps = [trainer.train_step(cfg.train.global_batch, lr=LR) for _ in range(STEPS)]
        one_process[objective] = [float(s[0]) for s in steps], [float(s[1]) for s in steps]
    results = launch(2, LAYOUTS, bounded_dataset, tmp_path / "launch")
    assert_same(results, one_process, [lay["name"] for lay in LAYOUTS])
