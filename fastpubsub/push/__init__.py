"""Push subscriptions: endpoints checked (endpoints.py), requests signed (signing.py) and sent (worker.py)."""
