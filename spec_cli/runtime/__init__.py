"""The decoding runtime every command shares: loaded models and contexts (engine), a configuration's drafter chain,
planner and statistics (session), the step loop (generate), and llama-lookup's tools (lookup, lookup_offline)."""
