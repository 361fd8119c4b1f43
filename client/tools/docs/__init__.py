"""Tools that write parts of the documentation from the code: the map of docs/design.md
(`import_map.py`: the package-level import graph of backend/, with kernels/ below it and the doors
above, drawn as docs/design_map.png and listed as docs/design_map.txt; tests/test_design_map.py
checks the list is current). Run from the repository root:

    python -m client.tools.docs.import_map [--out docs/design_map.png] [--check]
"""
