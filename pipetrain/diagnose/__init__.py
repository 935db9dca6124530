"""Seeing inside a run: profiler traces per action (``profile``), a gradient report across
stages (``grads``), and a hang doctor that names who waits for whom (``doctor``).

Modules are imported by path; nothing here changes a run's numbers.
"""
