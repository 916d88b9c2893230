"""ucpd_client: the trainer-side library of ucpd.

    from ucpd_client import Checkpointer, placement as P
"""
