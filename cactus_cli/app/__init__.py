"""Layer 3: what the commands do, without a terminal: settings and profiles, runtime, the grid runner, calibrate, chat, eval tasks, the lm-eval adapter."""
