"""Choosing a run's batch and placement: the cost model (a run's time from a hardware profile),
attention's cost, the search over policies, the planner behind --max-batch and flexh2o.plan, and
pipeline plans."""
