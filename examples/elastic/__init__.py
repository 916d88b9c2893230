"""The elastic scene: an elastic torchrun job under ``ucpd run`` loses a node and resumes from RAM
on the survivor with another layout. ``train.py`` is the torchrun worker, ``scene.py`` plays
the scene on one machine (two simulated nodes) and checks it."""
