"""The one grid runner and what it reports: bench, calibrate and eval run configurations over prompts
through runner.py; calibration.py chooses delta and k from its rows; variants.py loads one engine per
variant; report.py writes the --json and CSV documents."""
