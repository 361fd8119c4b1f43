"""The map that opens docs/design.md: backend/'s import graph by package, drawn from the source.

    python -m client.tools.docs.import_map [--out docs/design_map.png] [--check]

Reads every import statement of backend/ (with ast: those under TYPE_CHECKING and inside functions
count too), collapses each module to its layer package, and adds kernels/ as one node below
everything and the doors (serving/, openai_server/, model_repository/) as one node above the
engine. Writes the picture (one box per package, lowest layer at the bottom, an arrow from importer
to imported, each box with its module count) and, beside it, the edges as text (`design_map.txt`:
one `importer -> imported` line per package edge, top of the map first), which
tests/test_design_map.py compares with the source, so a new cross-package import fails until the
map is regenerated. `--check` only compares the text and exits 1 when it is stale.

This module is also where the import graph is read for tests/test_import_graph.py (`LAYERS`,
`module_name`, `imports_of`, `graph`): one reading for the rule and its picture. No torch;
matplotlib loads only to draw.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BACKEND = ROOT / "backend"
KERNELS = ROOT / "kernels"
DOORS = ("serving", "openai_server", "model_repository")
# backend's packages, lowest first: a module may import its own package and those before it
# (docs/design.md, "Map"; tests/test_import_graph.py enforces it). text (tokenizers) sits just above
# core; models below the worker that runs them; speculative decoding between the worker it drives
# and the engine that owns it.
LAYERS = ("core", "text", "kv", "sched", "models", "worker", "speculative", "engine")
# the map's rows, bottom to top: the kernels below backend, the doors above it
NODES = ("kernels", *LAYERS, "doors")
DEFAULT_OUT = Path("docs") / "design_map.png"  # from the repository root


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def backend_modules() -> dict[str, Path]:
    return {module_name(p): p for p in BACKEND.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` a file imports (`from backend.x import y` is backend.x.y when that
    is a module, else backend.x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph() -> dict[str, set[str]]:
    """backend's module graph: each module and the backend modules it imports."""
    modules = backend_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def node_of(module: str) -> str | None:
    """The map's node of a module: its layer package, `kernels` or `doors`. `backend` itself (the
    lazy public API, `backend/__init__.py`) is no node of its own: imported, it stands for the
    engine, the top it exports from; as an importer it is skipped (it imports by name, lazily)."""
    parts = module.split(".")
    if parts[0] == "backend":
        return parts[1] if len(parts) > 1 else None
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] in DOORS:
        return "doors"
    raise ValueError(f"{module} is on no node of the map")


def node_files() -> dict[str, list[Path]]:
    """The files of each node of the map."""
    files: dict[str, list[Path]] = {node: [] for node in NODES}
    for top in ("backend", "kernels", *DOORS):
        for path in python_files(ROOT / top):
            node = node_of(module_name(path))
            if node is not None:
                files[node].append(path)
    return files


def package_graph() -> dict[str, set[str]]:
    """The map's edges: each node and the nodes it imports (itself left out)."""
    modules = {**backend_modules(), **{module_name(p): p for p in python_files(KERNELS)}}
    edges: dict[str, set[str]] = {node: set() for node in NODES}
    for node, paths in node_files().items():
        for path in paths:
            for target in imports_of(path, modules):
                to = node_of(target) or "engine"
                if to != node:
                    edges[node].add(to)
    return edges


def rank(node: str) -> int:
    return NODES.index(node)


def sorted_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every edge, the map's top first: by importer, then by imported, each from the top down."""
    return sorted(((a, b) for a, targets in edges.items() for b in targets), key=lambda e: (-rank(e[0]), -rank(e[1])))


def edges_text(edges: dict[str, set[str]]) -> str:
    return "".join(f"{a} -> {b}\n" for a, b in sorted_edges(edges))


def module_counts() -> dict[str, int]:
    return {node: len(paths) for node, paths in node_files().items()}


# The picture: one column of boxes, NODES bottom to top. An import of the package just below is a
# straight arrow down the middle; every longer one an arc beside the column, an importer's arcs all
# on one side (the sides alternate from the top down) and in one colour, the longer ones outside.
BOX_W, BOX_H, ROW = 2.7, 0.62, 1.0
RAD = 0.4  # arc3 curvature: an arc's bulge is RAD/2 of its length


def layout(edges: dict[str, set[str]]):
    """(straight edges, arcs): an arc is (importer, imported, side, start y, end y), side +1 right."""
    straight, long = [], []
    for a, b in sorted_edges(edges):
        (straight if rank(a) - rank(b) == 1 else long).append((a, b))
    importers = sorted({a for a, _ in long}, key=rank, reverse=True)
    side = {a: (1 if i % 2 == 0 else -1) for i, a in enumerate(importers)}
    # attachment points on a box's side: arcs leaving in its lower half (the shortest lowest),
    # arcs arriving in its upper half (the shortest highest), so arcs of one box nest, not cross
    leaving: dict[tuple[str, int], list[tuple[str, str]]] = {}
    arriving: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for a, b in long:
        leaving.setdefault((a, side[a]), []).append((a, b))
        arriving.setdefault((b, side[a]), []).append((a, b))
    span = lambda e: rank(e[0]) - rank(e[1])  # noqa: E731
    start, end = {}, {}
    for (node, _), es in leaving.items():
        es.sort(key=lambda e: (span(e), e))
        for i, e in enumerate(es):
            start[e] = rank(node) * ROW - BOX_H * (0.42 - 0.34 * i / max(len(es) - 1, 1))
    for (node, _), es in arriving.items():
        es.sort(key=lambda e: (span(e), e))
        for i, e in enumerate(es):
            end[e] = rank(node) * ROW + BOX_H * (0.42 - 0.34 * i / max(len(es) - 1, 1))
    arcs = [(a, b, side[a], start[(a, b)], end[(a, b)]) for a, b in long]
    return straight, arcs


def label(node: str, count: int) -> list[str]:
    """A box's lines: its name (bold), then what it holds."""
    if node == "doors":
        return ["doors", f"{DOORS[0]}/, {DOORS[1]}/,", f"{DOORS[2]}/: {count} modules"]
    return [f"{node}/" if node == "kernels" else f"backend/{node}/", f"{count} modules"]


def draw(edges: dict[str, set[str]], counts: dict[str, int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    straight, arcs = layout(edges)
    importers = [n for n in reversed(NODES) if edges[n]]
    palette = plt.get_cmap("tab10").colors
    colour = {n: palette[i % len(palette)] for i, n in enumerate(importers)}
    half = BOX_W / 2
    reach = max([RAD / 2 * (rank(a) - rank(b)) * ROW for a, b, *_ in arcs], default=0) + half + 0.3
    top = (len(NODES) - 1) * ROW
    unit = 0.62  # inches per data unit
    fig = plt.figure(figsize=(2 * reach * unit, (top + 1.9) * unit), dpi=150)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-0.75, top + 1.15)
    ax.set_aspect("equal")
    ax.axis("off")
    fill = {"kernels": "#e6e6e6", "doors": "#fde2c4"}
    for node in NODES:
        y = rank(node) * ROW
        ax.add_patch(FancyBboxPatch((-half, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0,rounding_size=0.08",
                                    facecolor=fill.get(node, "#d7e8f7"), edgecolor="#333333", linewidth=1, zorder=3))
        name, *details = label(node, counts[node])
        high = 0.1 if len(details) == 1 else 0.16
        ax.text(0, y + high, name, ha="center", va="center", fontsize=9.5, fontweight="bold", zorder=4)
        for i, line in enumerate(details):
            ax.text(0, y - 0.14 - 0.15 * i + (0.1 if len(details) > 1 else 0), line, ha="center", va="center",
                    fontsize=7 if len(details) == 1 else 6.5, zorder=4)
    arrow = dict(arrowstyle="-|>", mutation_scale=9, linewidth=1.1, shrinkA=0, shrinkB=0, zorder=2)
    for a, b in straight:
        ax.add_patch(FancyArrowPatch((0, rank(a) * ROW - BOX_H / 2), (0, rank(b) * ROW + BOX_H / 2),
                                     color=colour[a], **arrow))
    for a, b, side, y0, y1 in arcs:
        # arc3 bends to the right of the direction of travel for a negative rad: down the right side.
        # An import against the layers (tests/test_import_graph.py fails on it) goes up, red and dashed.
        down = rank(a) > rank(b)
        ax.add_patch(FancyArrowPatch((side * half, y0), (side * half, y1),
                                     connectionstyle=f"arc3,rad={-side * RAD if down else side * RAD}",
                                     color=colour[a] if down else "red", linestyle="-" if down else "--", **arrow))
    ax.text(0, top + 0.75, "backend/ by layer: an arrow from importer to imported", ha="center", va="center",
            fontsize=9)
    ax.text(0, -0.6, "python -m client.tools.docs.import_map", ha="center", va="center", fontsize=7,
            family="monospace", color="#555555")
    fig.savefig(path, dpi=150, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.tools.docs.import_map", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / DEFAULT_OUT,
                        help=f"the picture (PNG); its edges go beside it, as .txt (default: {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true",
                        help="draw nothing: exit 1 when the .txt beside --out is not the graph of the source")
    args = parser.parse_args(argv)
    edges = package_graph()
    text = edges_text(edges)
    listing = args.out.with_suffix(".txt")
    if args.check:
        current = listing.read_text() if listing.exists() else ""
        if current != text:
            print(f"{listing} is stale: run python -m client.tools.docs.import_map --out {args.out}", file=sys.stderr)
            return 1
        print(f"{listing} is current")
        return 0
    upward = [f"{a} -> {b}" for a, b in sorted_edges(edges) if rank(a) <= rank(b)]
    if upward:
        print("imports against the layers (drawn anyway): " + "; ".join(upward), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(edges, module_counts(), args.out)
    listing.write_text(text)
    print(f"wrote {args.out} and {listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
