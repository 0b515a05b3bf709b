"""The import graph: no cycles among the project's modules (the layers contract itself is
`lint-imports`, run by `make test`)."""

import grimp


def test_no_import_cycles():
    graph = grimp.build_graph("engine", "models", "api", exclude_type_checking_imports=False)
    cycles = sorted(
        {
            tuple(sorted((m, imported)))
            for m in graph.modules
            for imported in graph.find_modules_directly_imported_by(m)
            if graph.chain_exists(importer=imported, imported=m)
        }
    )
    assert not cycles, f"import cycles through: {cycles}"


def test_every_module_is_in_a_layer():
    """The contracts in pyproject.toml name every module: each engine and models module lies under one of its
    package's layers, and no layer names a module that does not exist (a renamed file is noticed)."""
    from pathlib import Path

    import tomllib

    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    graph = grimp.build_graph("engine", "models", "api")
    for contract in config["tool"]["importlinter"]["contracts"]:
        for container in contract.get("containers", []):
            layers = [f"{container}.{name.strip()}" for layer in contract["layers"] for name in layer.split("|")]
            modules = {m for m in graph.modules if m.startswith(container + ".")}
            uncovered = sorted(m for m in modules if not any(m == x or m.startswith(x + ".") for x in layers))
            assert not uncovered, f"modules in no layer of {container}: {uncovered}"
            missing = sorted(x for x in layers if x not in modules)
            assert not missing, f"layers naming no module: {missing}"
