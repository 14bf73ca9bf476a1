"""Pipeline parallelism: stages, schedules as action lists, the executor, p2p, the simulator."""
