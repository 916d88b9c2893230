"""The team of daemons: what spans nodes.

- ``membership`` — which peers are alive (heartbeats in, a view out); pure.
- ``commit`` — the global commit protocol as a state machine: events in, messages and actions out; pure.
- ``placement`` — where a node's replicas and parity groups go (failure-domain aware); pure.
- ``parity`` — the parity layout of a group (rotating codewords) and its encode/decode; pure.
- ``transport`` — ZeroMQ links between daemons: authenticated envelopes, heartbeats, bulk frames.
- ``team`` — the glue the daemon plugs in: replication, the commit policy, restore sources from peers.
"""
