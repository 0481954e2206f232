use sqlx::{Arguments, Encode, Type};

use super::{ColumnName, VersionedBackend, VersionedTableError};

/// The column values of one versioned UPDATE or create-only INSERT, bound as parameters.
///
/// Handed to the closure of [`VersionedTable::update_if_version`] and
/// [`VersionedTable::insert_new`]. A mistake (an invalid column name, setting the id or
/// version column, a column set twice, a value that cannot be encoded) is remembered and
/// returned as the operation's error; the statement is then not run.
///
/// [`VersionedTable::update_if_version`]: super::VersionedTable::update_if_version
/// [`VersionedTable::insert_new`]: super::VersionedTable::insert_new
pub struct SetValues<'args, DB: VersionedBackend> {
    pub(super) columns: Vec<(ColumnName, String)>,
    pub(super) args: DB::Arguments,
    pub(super) error: Option<VersionedTableError>,
    reserved: [(ColumnName, &'static str); 2],
    // sqlx 0.9 encodes each value when it is added, so nothing borrows from `'args` any
    // more; the parameter stays so the public type (and the bounds callers meet) is unchanged.
    borrows: std::marker::PhantomData<fn(&'args ())>,
}

impl<'args, DB: VersionedBackend> SetValues<'args, DB> {
    pub(super) fn new(id: &ColumnName, version: &ColumnName) -> Self {
        Self {
            columns: Vec::new(),
            args: DB::Arguments::default(),
            error: None,
            reserved: [
                (id.clone(), "id column"),
                (version.clone(), "version column"),
            ],
            borrows: std::marker::PhantomData,
        }
    }

    /// Sets `column` to `value`, bound as a parameter.
    pub fn value<T>(&mut self, column: &str, value: T) -> &mut Self
    where
        T: 'args + Encode<'args, DB> + Type<DB>,
    {
        if self.error.is_none() {
            if let Err(error) = self.try_value(column, value) {
                self.error = Some(error);
            }
        }
        self
    }

    fn try_value<T>(&mut self, column: &str, value: T) -> Result<(), VersionedTableError>
    where
        T: 'args + Encode<'args, DB> + Type<DB>,
    {
        let name =
            ColumnName::new(column).map_err(|source| VersionedTableError::InvalidIdentifier {
                role: "value column",
                source,
            })?;
        if let Some((_, role)) = self.reserved.iter().find(|(c, _)| *c == name) {
            return Err(VersionedTableError::ReservedColumn {
                column: column.to_owned(),
                role,
            });
        }
        if self.columns.iter().any(|(c, _)| *c == name) {
            return Err(VersionedTableError::DuplicateColumn {
                column: column.to_owned(),
            });
        }
        let placeholder = self
            .bind(value)
            .map_err(|source| VersionedTableError::Bind {
                column: column.to_owned(),
                source,
            })?;
        self.columns.push((name, placeholder));
        Ok(())
    }

    /// Binds one more argument and returns its placeholder (`$3` or `?`).
    pub(super) fn bind<T>(&mut self, value: T) -> Result<String, sqlx::error::BoxDynError>
    where
        T: 'args + Encode<'args, DB> + Type<DB>,
    {
        self.args.add(value)?;
        Ok(self.placeholder())
    }

    /// Binds a version number.
    pub(super) fn bind_i64(&mut self, value: i64) -> Result<String, sqlx::error::BoxDynError> {
        DB::add_i64(&mut self.args, value)?;
        Ok(self.placeholder())
    }

    fn placeholder(&self) -> String {
        let mut placeholder = String::new();
        // Writing into a String cannot fail.
        let _ = self.args.format_placeholder(&mut placeholder);
        placeholder
    }
}
