"""Training (docs/architecture.md): two recipes that read top to bottom, on what they share.

The rooms, each folder's purpose in its __init__.py: run/ the run's life, dist/ distribution over processes,
flow/ and masked/ the two recipes, planner/ `difrl plan`. Here: what both recipes share (scaffold, iteration,
reward_stage, metrics, ema, precision), the typed configs (config and its sections) and the commands (recipes,
check, export, entry).
"""
