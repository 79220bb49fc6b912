"""A snapshot of a live supervision tree, and its rendering for the terminal."""

from __future__ import annotations

from typing import Any

import attrs
from rich.tree import Tree

from actors import ActorNotRunning
from supervisors._api import SupervisorRef

__all__ = ["TreeNode", "render_tree", "snapshot_tree"]


@attrs.frozen
class TreeNode:
    id: str
    kind: str  # "worker" | "supervisor"
    state: str  # "running" | "restarting" | "undefined"
    restarts: int
    mailbox: int
    detail: str = ""
    children: tuple[TreeNode, ...] = ()


async def snapshot_tree(root: SupervisorRef, name: str = "root") -> TreeNode:
    """Walk the tree from ``root`` (children supervisors recursively)."""
    stats = await root.statistics()
    nodes = []
    for info in await root.which_children():
        actor = info.ref.statistics()
        if info.kind == "supervisor" and info.state == "running":
            try:
                child = await snapshot_tree(SupervisorRef(info.ref), info.id)
            except ActorNotRunning:
                child = TreeNode(info.id, info.kind, "restarting", actor.restarts, 0)
            nodes.append(attrs.evolve(child, restarts=actor.restarts))
        else:
            nodes.append(
                TreeNode(info.id, info.kind, info.state, actor.restarts, actor.mailbox_size)
            )
    return TreeNode(
        name,
        "supervisor",
        "running",
        0,
        0,
        f"{stats.strategy}, "
        f"{stats.restarts_in_window}/{stats.intensity} restarts in {stats.period:g}s",
        tuple(nodes),
    )


_STATE_STYLE = {"running": "green", "restarting": "yellow", "undefined": "red"}


def render_tree(node: TreeNode, tree: Tree | None = None) -> Tree:
    """A rich Tree of ``node``."""
    style = _STATE_STYLE.get(node.state, "white")
    label = f"[bold]{node.id}[/bold] [{style}]{node.state}[/{style}]"
    if node.kind == "supervisor":
        label += f" [dim]({node.detail})[/dim]" if node.detail else ""
    if node.restarts:
        label += f" [yellow]restarts={node.restarts}[/yellow]"
    if node.mailbox:
        label += f" [dim]mailbox={node.mailbox}[/dim]"
    branch = Tree(label) if tree is None else tree.add(label)
    for child in node.children:
        render_tree(child, branch)
    return branch


def tree_to_dict(node: TreeNode) -> dict[str, Any]:
    return attrs.asdict(node)
