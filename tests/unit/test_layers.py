"""The import graph: no cycles among the project's modules (the layers contract itself is
`lint-imports`, run by `make test`)."""
import grimp


def test_no_import_cycles():
    graph = grimp.build_graph("engine", "models", "api", exclude_type_checking_imports=False)
    cycles = sorted({tuple(sorted((m, imported))) for m in graph.modules
                     for imported in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=imported, imported=m)})
    assert not cycles, f"import cycles through: {cycles}"

