"""The one grid sweep and what it reports: bench, calibrate and eval run configurations over prompts
through sweep.py; calibration.py chooses delta and k from its rows; variants.py loads one engine per
variant; report.py writes the --json and CSV documents."""
