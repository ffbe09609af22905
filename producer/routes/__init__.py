"""The API's routes, one module per resource; `producer/api.py` wires them."""
