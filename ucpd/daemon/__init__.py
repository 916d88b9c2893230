"""The node daemon: socket loop (server), RAM store (slots, versions), restore planning, flush."""
