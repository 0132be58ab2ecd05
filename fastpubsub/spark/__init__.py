"""Spark jobs over the broker's tables (extra `spark`): `launch` starts them, `report` is the report job."""
