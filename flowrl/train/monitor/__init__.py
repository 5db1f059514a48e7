"""Reward hacking caught while it happens (docs/monitor.md): image statistics (image_stats.py), the rules
over the monitor's evaluations (rules.py), the config section's checks (validate.py), and the monitor
inside the image trainer (watch.py)."""
