"""`vx bench serve`: the load generator's HTTP client, the run and its report, and the plots."""
