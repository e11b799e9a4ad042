"""Dependencies point one way: no import cycles, and each package imports only the layers
below it (docs/architecture.md draws them). `python tests/import_graph.py` prints cycles."""

from import_graph import cycles, module_graph, unit, unit_graph

# What each package may import besides itself. The bottom modules (config, atomic, device,
# cost, hardware, layout, process, budget, errors, fields) are shared by everything above them.
BOTTOM = {"config", "budget", "errors", "atomic", "device", "cost", "hardware", "layout", "process", "fields"}
ALLOWED = {
    "model": BOTTOM,
    "data": BOTTOM,
    "parallel": BOTTOM | {"model"},
    "train": BOTTOM | {"model", "data", "parallel"},
    "plan": BOTTOM,
    "tune": BOTTOM | {"model", "data", "parallel", "train", "plan"},
    "eval": BOTTOM | {"model", "data", "train"},
    "export": BOTTOM | {"model", "data", "train", "eval"},
}


def test_there_is_no_import_cycle():
    graph = module_graph()
    assert len(graph) > 50  # the graph really was read
    assert cycles(graph) == []
    assert cycles(unit_graph(graph)) == []


def test_packages_import_only_the_layers_below_them():
    graph = module_graph()
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                   if unit(module) in ALLOWED and unit(target) != unit(module)
                   and unit(target) not in ALLOWED[unit(module)] and unit(target) != "ember")
    assert wrong == []
    bottom = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                    if unit(module) in BOTTOM and unit(target) not in BOTTOM | {"ember"})
    assert bottom == []


def test_the_checker_finds_a_cycle():
    made_up = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(made_up) == [["a", "b", "c"]]
    assert unit("ember.train.trainer") == "train" and unit("ember.config") == "config"
    assert cycles(unit_graph({"ember.train.x": {"ember.plan.y"}, "ember.plan.y": {"ember.train.z"},
                              "ember.train.z": set()})) == [["plan", "train"]]
