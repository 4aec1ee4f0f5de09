"""Drafter training: `python -m train train=eagle3|dflash|mtp|draft_model arch.model=...`.

Self-distilled data (train/data.py: the target's own answers to a prompt file or to
instructions it writes itself), one objective per method over the engines' own modules
(train/eagle3.py, train/dflash.py, train/mtp.py), and one resumable loop
(train/loop.py) that writes a drafter directory the harness's loaders read strictly,
with its training record and curves beside it.
"""
