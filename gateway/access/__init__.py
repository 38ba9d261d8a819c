"""Who may connect and what each client may do: passwords, ACLs, limits."""
