"""Messages: the publish path, the record schema, retained messages and $SYS."""
