"""Who may call what over HTTP: roles and their credentials, agent capabilities, the route
gate, bind and TLS rules, the audit trail (DESIGN §15)."""
