"""The parity group's answers to the peers (``--parity``), registered with the node's
``serve.PeerServer``: a member's manifest and units of the group's parity, the blocks a rebuild
reads, and a step's units of a blob (``parity_group.ParityGroup`` does the work). A node started
without ``--parity`` refuses these types, saying so."""

from __future__ import annotations

from .serve import PeerServer

PARITY_TYPES = ("parity_manifest", "parity_manifest_of", "parity_unit", "parity_block", "blob_unit")


def register_parity(server: PeerServer, parity, rank: int) -> None:
    """``parity``: this node's ``ParityGroup``, or None (the types are refused)."""
    if parity is None:
        server.refuse(PARITY_TYPES, f"node {rank} keeps no parity (started without --parity)")
        return

    def manifest(src: int, b: dict, frames: list):
        parity.on_manifest(src, b)
        return {}, []

    def unit(src: int, b: dict, frames: list):
        parity.on_unit(b, frames)
        return {}, []

    server.register("parity_manifest", manifest)
    server.register("parity_manifest_of", lambda src, b, frames: (parity.manifest_of(b["origin"], b["step"]), []))
    server.register("parity_unit", unit)
    server.register("parity_block", lambda src, b, frames: ({}, parity.on_block(b)))
    server.register("blob_unit", lambda src, b, frames: ({}, parity.on_blob_unit(b)))
