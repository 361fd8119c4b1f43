"""Load tests: the Locust files (`locustfile.py`, `locust_common.py`) and the soak test against a
real tritonserver (`soak.py`, `soak_locustfile.py`)."""
