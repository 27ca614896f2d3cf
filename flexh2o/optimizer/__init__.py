"""Policy optimizer: hardware profiles, the cost model and the search."""
