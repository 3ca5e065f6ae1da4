"""``tokentrail run``: the whole pipeline in one process on embedded defaults.

``main.execute`` stacks the services (broker, data plane, engine, stages, worker),
plays the rollouts with the driver, waits for their outcomes and reports.
"""
