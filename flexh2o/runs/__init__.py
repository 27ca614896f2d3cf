"""A run set up from its flags: the policy planned, fitted or as given, the engine loaded, the prompts
(synthetic or from a file), and the throughput report."""
