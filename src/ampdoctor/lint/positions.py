"""Where nodes are in the source (line and column ranges), computed only for reported nodes."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider

from ampdoctor.lint.fixes import _NEWLINE
from ampdoctor.lint import tree


def node_positions(module: cst.Module, text: str, nodes: list[cst.CSTNode]) -> dict[cst.CSTNode, CodeRange]:
    """Where ``nodes`` are in the source.

    libcst computes positions by generating the code of the whole module, which costs twice
    the parse. Only the top-level statements that hold the nodes are generated here, each as a
    module of its own, and placed by finding their code (an exact part of the source: a parse
    round-trips) in the text. When that is ambiguous, the whole module is generated as usual."""
    left = {id(n) for n in nodes}
    holders: list[cst.BaseStatement] = []
    for stmt in module.body:
        if not left:
            break
        hit = id(stmt) in left
        left.discard(id(stmt))
        for n in tree.walk(stmt):
            if id(n) in left:
                left.discard(id(n))
                hit = True
        if hit:
            holders.append(stmt)
    whole = None
    if not left:
        whole = {}
        for stmt in holders:
            single = module.with_changes(header=(), body=(stmt,), footer=())
            code = single.code
            start = text.find(code)
            if not code or start < 0 or text.find(code, start + 1) >= 0:
                whole = None
                break
            shift = len(_NEWLINE.findall(text, 0, start))
            for node, rng in MetadataWrapper(single, unsafe_skip_copy=True).resolve(PositionProvider).items():
                whole[node] = rng if not shift else CodeRange(CodePosition(rng.start.line + shift, rng.start.column),
                                                             CodePosition(rng.end.line + shift, rng.end.column))
    if whole is None:
        return dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))
    return whole
