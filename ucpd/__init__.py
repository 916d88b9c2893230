"""ucpd: a per-node asynchronous in-memory checkpoint daemon.

Sub-packages, one job each:
  ucpd.ucl      placements (UCL) and the pure resharding planner/executor
  ucpd.format   the universal on-disk format (safetensors shards + ucp.json)
  ucpd.daemon   the node daemon: server loop, store, versions, flush
  ucpd.native   thin wrapper over the C++ extension (copy, CRC32C, parity, CUDA)
"""

__version__ = "0.1.0"
