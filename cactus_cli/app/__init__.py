"""Layer 3: what the commands do, without a terminal. Here: the session (a loaded pair and its
settings), runtime (settings to an engine), the chat conversation, the prompts, the tensor-parallel
follower. Folders: config/ (settings, profiles), grid/ (bench and calibrate), eval/, serve/, data/."""
