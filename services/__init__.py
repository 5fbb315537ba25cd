"""downpour services: the parameter server, the worker, and the command line around them."""
