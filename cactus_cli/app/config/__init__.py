"""Settings and where they come from: the Settings record (settings), YAML profiles on disk
(profile_files), and parsing what users type (parsing)."""
